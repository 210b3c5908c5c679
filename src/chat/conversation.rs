//! Conversations as datasets write them, normalised the way the speculators
//! stack normalises them: ShareGPT (`from`/`value`) or OpenAI
//! (`role`/`content`) messages with canonical roles.

use serde_json::{Map, Value};

/// The roles a template sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Role {
    /// `human`, `user`.
    User,
    /// `gpt`, `assistant`, and any role not known.
    Assistant,
    /// `system`.
    System,
    /// `tool`.
    Tool,
}

impl Role {
    /// The canonical role of a dataset's role name; `None` for one not known (counted as assistant).
    pub fn parse(name: &str) -> Option<Role> {
        Some(match name {
            "human" | "user" => Role::User,
            "gpt" | "assistant" => Role::Assistant,
            "system" => Role::System,
            "tool" => Role::Tool,
            _ => return None,
        })
    }

    /// Its name in a template's messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::System => "system",
            Role::Tool => "tool",
        }
    }
}

/// The message styles of conversation datasets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// `{"conversations": [{"from": "human", "value": ...}]}`.
    ShareGpt,
    /// `{"messages": [{"role": "user", "content": ...}], "tools": [...]}`.
    OpenAi,
}

/// A normalised conversation: messages as the template sees them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Conversation {
    /// `{role, content, ...}` objects, roles canonical.
    pub messages: Vec<Value>,
    /// Each message's role.
    pub roles: Vec<Role>,
    /// The `tools` the template gets, if any.
    pub tools: Option<Value>,
    /// Role names not known, counted as assistant (for one warning each).
    pub unknown_roles: Vec<String>,
}

impl Conversation {
    /// Normalises `messages` in `style`; `tools` is the line's `tools` (a list, or JSON text of one).
    pub fn parse(style: Style, messages: &Value, tools: Option<&Value>) -> Result<Self, String> {
        let field = match style {
            Style::ShareGpt => "conversations",
            Style::OpenAi => "messages",
        };
        let list = messages.as_array().ok_or_else(|| format!("`{field}` must be a list of messages"))?;
        let mut c = Conversation::default();
        // Names already listed in `unknown_roles`: one lookup per message, whatever their number.
        let mut unknown = std::collections::HashSet::new();
        for (i, m) in list.iter().enumerate() {
            let m = m.as_object().ok_or_else(|| format!("{field}[{i}] must be an object"))?;
            // speculators reads `from` first, then `role`; `value` first, then `content`.
            let (role_keys, content_keys) = match style {
                Style::ShareGpt => (["from", "role"], ["value", "content"]),
                Style::OpenAi => (["role", "from"], ["content", "value"]),
            };
            let role_name = role_keys.iter().find_map(|k| m.get(*k)).unwrap_or(&Value::Null);
            let role_name = match role_name {
                Value::String(s) => s.as_str(),
                Value::Null => "",
                other => return Err(format!("{field}[{i}]: the role must be a string, got {}", short(other))),
            };
            let role = Role::parse(role_name).unwrap_or_else(|| {
                if unknown.insert(role_name) {
                    c.unknown_roles.push(role_name.to_string());
                }
                Role::Assistant
            });
            let content = content_keys.iter().find_map(|k| m.get(*k).filter(|v| !v.is_null()));
            let content = match content {
                None => Value::String(String::new()),
                Some(v @ (Value::String(_) | Value::Array(_))) => v.clone(),
                Some(other) => {
                    return Err(format!("{field}[{i}]: the content must be a string or a list, got {}", short(other)))
                }
            };
            let mut msg = Map::new();
            msg.insert("role".into(), role.as_str().into());
            msg.insert("content".into(), content);
            if style == Style::OpenAi {
                // Other fields (tool_calls, name, tool_call_id, reasoning) reach the template; nulls do not.
                for (k, v) in m {
                    if !matches!(k.as_str(), "role" | "content" | "from" | "value") && !v.is_null() {
                        msg.insert(k.clone(), v.clone());
                    }
                }
                // As speculators does: reasoning under either key is given under both.
                if let Some(r) = msg.get("reasoning_content").or_else(|| msg.get("thinking")).cloned() {
                    msg.insert("reasoning_content".into(), r.clone());
                    msg.insert("thinking".into(), r);
                }
            }
            c.messages.push(Value::Object(msg));
            c.roles.push(role);
        }
        c.tools = match tools {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                Some(serde_json::from_str(s).map_err(|e| format!("`tools` is a string but not JSON: {e}"))?)
            }
            Some(v @ Value::Array(_)) => Some(v.clone()),
            Some(other) => return Err(format!("`tools` must be a list, got {}", short(other))),
        };
        Ok(c)
    }

    /// Drops the turns after the last assistant turn (they supervise nothing).
    pub fn drop_trailing(&mut self) {
        let keep = self.roles.iter().rposition(|r| *r == Role::Assistant).map_or(0, |i| i + 1);
        self.roles.truncate(keep);
        self.messages.truncate(keep);
    }
}

fn short(v: &Value) -> String {
    crate::clip(&v.to_string(), 40).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn normalises_roles_content_and_reasoning() {
        let m =
            json!([{"from": "human", "value": "hi"}, {"from": "bot", "value": null}, {"from": "gpt", "value": "x"}]);
        let c = Conversation::parse(Style::ShareGpt, &m, None).unwrap();
        assert_eq!(c.roles, vec![Role::User, Role::Assistant, Role::Assistant]);
        assert_eq!(c.messages[1], json!({"role": "assistant", "content": ""}));
        assert_eq!(c.unknown_roles, vec!["bot"]);
        let m = json!([{"role": "assistant", "content": "a", "thinking": "t", "name": null}, {"role": "user", "content": "u"}]);
        let mut c = Conversation::parse(Style::OpenAi, &m, Some(&json!("[{\"type\": \"function\"}]"))).unwrap();
        assert_eq!(
            c.messages[0],
            json!({"role": "assistant", "content": "a", "thinking": "t", "reasoning_content": "t"})
        );
        assert_eq!(c.tools, Some(json!([{"type": "function"}])));
        c.drop_trailing();
        assert_eq!(c.roles, vec![Role::Assistant]);
        let e = Conversation::parse(Style::OpenAi, &json!([{"role": 3}]), None).unwrap_err();
        assert!(e.contains("messages[0]: the role must be a string"), "{e}");
    }
}
